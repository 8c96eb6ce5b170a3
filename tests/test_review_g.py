"""Review findings on the compiled decode step and the model config checks (issue 13).

* The compiled decode step (``_kvsimd._decode_stack``) reads every layer array by pointer; it checks
  each one itself, once per call, so an array resized in place after the model checked it, or a
  bad tuple handed to it directly, is a KVSimdError naming the layer and entry, never an
  out-of-bounds read.  Those calls crash or read garbage on an unchecked build, so they run in a
  child process: a signal there fails the case instead of the whole run.
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
    _entry = {"ffn.w13": "ffn.w_in", "ffn.b1": "ffn.b_in"}.get(_path, _path)

    def _fn(p=_path, s=_shape, e=_ed):
        _resized_step(p, s, e)
    _fn.__name__ = "resized_" + _path.replace(".", "_")
    case(r"layers\[0\]\.%s must (have shape|be )" % re.escape(_entry))(_fn)


def _direct(edit, n_layers=2, **kw):
    """Call _decode_stack with the decoder's own layer tuples after ``edit(list of tuples)``."""
    m, cache = _decoder(n_layers)
    cfg = m.cfg
    fast = [list(t) for t in m._fast_layers()]
    edit(fast)
    plan = cache.step_plan(cfg.n_heads * cfg.head_dim, np.array([3]), np.array([3]), np.array([3]),
                           [[(False, 0, 4, 3)]], rope=(cfg.rope_theta, cfg.rope_style, cfg.rotary_dim))
    args = dict(layers=[tuple(t) for t in fast], x=np.zeros((1, cfg.d_model), np.float32), cache=cache, plan=plan,
                rms=True, eps=1e-6, act="silu", gated=True, parallel=False)
    args.update(kw)
    _kvsimd._decode_stack(**args)


def _set(l, i, value):
    def edit(fast):
        fast[l][i] = value(fast[l][i]) if callable(value) else value
    return edit


@case(r"layers\[0\]\.norm1\.w must be a float32 array of shape \(32,\), got None")
def direct_norm_none():
    _direct(_set(0, 0, None))


@case(r"layers\[1\]\.norm2\.w must have shape \(32,\), got \(31,\)")
def direct_norm_short():
    _direct(_set(1, 6, lambda a: a[:-1]))


@case(r"layers\[1\]\.attn\.bqkv must have shape \(64,\), got \(63,\)")
def direct_bias_short():
    _direct(_set(1, 3, np.zeros(63, np.float32)))


@case(r"layers\[0\]\.ffn\.w_in must be \[32, F\] with F >= 1 and even .*got shape \(32, 95\)")
def direct_w_in_odd():
    _direct(_set(0, 8, lambda a: np.ascontiguousarray(a[:, :95])))


@case(r"layers\[0\]\.ffn\.w2 must have shape \(48, 32\), got \(47, 32\)")
def direct_w2_rows():
    _direct(_set(0, 10, lambda a: a[:47]))


@case(r"layers\[0\]\.ffn\.w2 must have dtype float32, got float64")
def direct_w2_dtype():
    _direct(_set(0, 10, lambda a: a.astype(np.float64)))


@case(r"layers\[1\]\.attn\.wo must be C-contiguous")
def direct_wo_fortran():
    _direct(_set(1, 4, lambda a: np.asfortranarray(a)))


@case(r"layers\[0\]\.ffn\.b_in must be a numpy\.ndarray, got list")
def direct_bias_list():
    _direct(_set(0, 9, [0.0] * 96))


@case(r"layers\[0\] must be a tuple of the 18 arrays")
def direct_short_tuple():
    _direct(lambda fast: fast[0].pop())


@case(r"cache must be a KVCache, got NoneType")
def direct_cache_none():
    _direct(lambda fast: None, cache=None)


@case(r"plan must be a _StepPlan, got NoneType")
def direct_plan_none():
    _direct(lambda fast: None, plan=None)


@case(r"x must be a numpy\.ndarray, got NoneType")
def direct_x_none():
    _direct(lambda fast: None, x=None)


@case(r"act must be one of silu, gelu, gelu_tanh, relu, got 'tanh'")
def direct_bad_activation():
    _direct(lambda fast: None, act="tanh")


@case(r"layers\[0\]\.cross\.wo must have shape \(32, 32\), got \(8, 32\)")
def direct_cross_wo():
    m, cache, cross = _encdec()
    cfg = m.cfg
    fast = [list(t) for t in m._fast_layers()]
    fast[0][16] = fast[0][16][:8]
    plan = cache.step_plan(cfg.n_heads * cfg.head_dim, np.array([2]), np.array([2]), np.array([2]),
                           [[(False, 0, 3, 2)]])
    _kvsimd._decode_stack([tuple(t) for t in fast], np.zeros((1, cfg.d_model), np.float32), cache, plan,
                          False, 1e-5, "gelu", False, False, False, cross)


child_results = childcases.results_fixture(__name__, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_decode_step_checks_every_array_it_reads(name, child_results):
    childcases.check(name, child_results, CASES)


def test_decode_step_still_matches_the_numpy_layers():
    """The checks refuse nothing valid: the compiled step and the NumPy layers agree."""
    from test_streaming import random_decoder
    logits = []
    for fast in (True, False):
        m = random_decoder(n_layers=2)
        m.fast_decode = fast
        cache = m.new_cache(capacity=16, dtype="float32")
        m.prefill([1, 2, 3], cache=cache)
        logits.append(m.step([4], cache=cache))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


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
