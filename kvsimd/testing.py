"""Test helpers: the ISA switch, the bound against the float64 reference model, tiny random models."""
import contextlib
import inspect
import math
import os
import types

import numpy as np

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdError, KVSimdTypeError, KVSimdValueError

__all__ = ["use_isa", "REFERENCE_BOUNDS", "INT8_ACTIVATION_BOUND",
           "reference_error", "assert_matches_reference", "random_decoder",
           "random_encoder_decoder"]


@contextlib.contextmanager
def use_isa(name):
    """Run the block on ISA path ``name``, with the same checks as ``KVSIMD_FORCE_ISA``
    (unknown, not compiled or not supported by this CPU -> :class:`kvsimd.KVSimdISAError`).
    Process-global: meant for tests, not for concurrent use."""
    prev = _kvsimd.isa_info()
    _kvsimd._set_isa(name)
    try:
        yield name
    finally:
        _kvsimd._restore_isa(prev["active"], prev["forced"])


# ------------------------------------------------------------------------------ the reference bound
#: How far kvsimd's logits may be from :func:`kvsimd.reference.forward`, by cache dtype: the
#: largest |difference| over the compared rows, relative to the largest |reference logit|.
#: Measured on the tiny models of tests/test_reference_model.py (transformers families and the
#: option grid, 2 layers, seeds 0-3): float32 cache <= 4.4e-7 (float32 layer math), float16
#: cache <= 3.7e-4 (K/V rounded to fp16, 2^-11 relative, through every layer and the LM head).
#: The bounds leave a 10-20x margin; deeper or wider models may need their own (``bound=``).
#: int8 cache: against the reference that quantizes K/V by the same rule (reference.forward(kv="int8")),
#: what remains is that kvsimd's K/V differ from the float64 ones by float32 rounding, so a value at
#: the middle of two steps may round the other way (one step, max|block| / 127, in one component);
#: measured on the same tiny models (14 families, seeds 0-3): typically 1e-6, at most 1.4e-4 (a
#: step flipped); not derived, a stated bound.  (Against the float reference the same logits
#: differ by 2.8e-5 to 1.9e-2: the quantization itself.)
# int4 (KVCache(dtype="int4"): 4-bit K/V turned by the Hadamard matrix) against the reference that
# quantizes the same way: measured at most 7e-7 on the tiny models of the tests (scalar, avx2, avx512:
# no 4-bit step rounded the other way) before the query over int4 keys was rounded by the int8
# rule (as over int8 keys, where a query step may flip as well: see the int8 figures); a float
# reference is 1.2e-2 .. 2.3e-1 away (bloom's ALiBi model 5e-4).  The bound leaves room for one
# flipped step, as the int8 one does.
# int8/int4 (KVCache(dtype="int8/int4"): int8 keys, int4 values, both turned) against the reference
# that stores them the same way: measured at most 6.0e-7 (scalar, avx2, avx512; the families above,
# seeds 0-1), where a float reference is 7e-4 .. 2.0e-1 away.  The int4 bound: room for a flipped
# int8 key step as well as a 4-bit one.
REFERENCE_BOUNDS = {"float32": 1e-5, "float16": 4e-3, "int8": 2e-3, "int4": 5e-3, "int8/int4": 5e-3, "int4/int8": 5e-3}
# A model whose Q8_0/Q4_0/Q4_1 matrices take int8 activations (QMatrix activations="int8"), against
# the reference that rounds x the same way (kvsimd.reference.int8_rows): what remains is that x
# itself differs by float32 rounding from the float64 one, so a value near the middle of two steps
# may round the other way (one step of one term), and the layers after it see that difference.
# Measured on the tiny random models of the tests (q8_0 weights, 1-2 layers): at most 7.1e-3 of
# the largest |logit|; on SmolLM2 (30 layers): 3.8e-2.  Not a derived bound: a stated one.
INT8_ACTIVATION_BOUND = 2e-2


def reference_error(model, tokens, logits, *, src=None, positions=None, kv="float"):
    """``max |logits - ref| / max |ref|`` over the rows ``logits`` gives: ``[T, vocab]`` for every
    token, ``[k, vocab]`` for the last k, ``[vocab]`` for the last one.  ``ref`` is
    :func:`kvsimd.reference.forward` (float64) of ``tokens`` (``src``, ``positions`` as there)."""
    from kvsimd import reference
    ref = reference.forward(model, tokens, src=src, positions=positions, kv=kv)
    got = np.asarray(logits, dtype=np.float64)
    got2 = got[None] if got.ndim == 1 else got
    if got2.ndim != 2 or got2.shape[1] != ref.shape[1] or not 1 <= got2.shape[0] <= ref.shape[0]:
        raise KVSimdValueError("logits must be [k, vocab=%d] with 1 <= k <= %d tokens (or [vocab]), got shape %s"
                               % (ref.shape[1], ref.shape[0], got.shape))
    ref = ref[ref.shape[0] - got2.shape[0]:]
    return float(np.abs(got2 - ref).max() / np.abs(ref).max())


def assert_matches_reference(model, tokens, logits, *, src=None, positions=None, cache_dtype="float32",
                             bound=None):
    """Assert that ``logits`` (kvsimd's, of the last rows of ``tokens``: see :func:`reference_error`)
    are within ``bound`` (default ``REFERENCE_BOUNDS[cache_dtype]``) of the float64 reference
    model; returns the error."""
    if cache_dtype not in REFERENCE_BOUNDS:
        raise KVSimdValueError("cache_dtype must be one of %s, got %r" % (", ".join(REFERENCE_BOUNDS), cache_dtype))
    err = reference_error(model, tokens, logits, src=src, positions=positions,
                          kv=cache_dtype if cache_dtype.startswith("int") else "float")
    if bound is None:
        bound = REFERENCE_BOUNDS[cache_dtype]
    else:
        bound = _kvsimd._need_real(bound, "bound")
        if not bound >= 0:
            raise KVSimdValueError("bound must be a number >= 0, got %r" % bound)
    assert err <= bound, ("logits differ from kvsimd.reference.forward by %.3g of the largest |logit| "
                          "(bound %g for a %s cache)" % (err, bound, cache_dtype))
    return err


# ------------------------------------------------------------------------------ tiny random models
def _nn():
    """The model classes (imported here, once per call, so they may move without touching the rest)."""
    from kvsimd.nn import AttentionWeights, FFNWeights, LayerWeights, ModelConfig, NormWeights
    from kvsimd.nn import Decoder, EncoderDecoder
    return types.SimpleNamespace(AttentionWeights=AttentionWeights, FFNWeights=FFNWeights, LayerWeights=LayerWeights,
                                 ModelConfig=ModelConfig, NormWeights=NormWeights, Decoder=Decoder,
                                 EncoderDecoder=EncoderDecoder)


class _Weights:
    """Draws the weights of one random model: a linear ``[fan_in, fan_out]`` has standard deviation
    ``scale / sqrt(fan_in)`` (activations keep their size through it), a bias 0.1 * scale, a norm
    weight 1 + 0.1 N(0, 1), embeddings and position tables N(0, 1)."""

    def __init__(self, nn, seed, scale, bias):
        self.nn, self.gen, self.scale, self.bias = nn, np.random.default_rng(seed), scale, bias

    def normal(self, *shape, std=1.0):
        return (self.gen.standard_normal(shape) * std).astype(np.float32)

    def linear(self, n_in, n_out):
        return self.normal(n_in, n_out, std=self.scale / math.sqrt(n_in))

    def b(self, n):
        return self.normal(n, std=0.1 * self.scale) if self.bias else None

    def norm(self, cfg, width=None):
        n = cfg.d_model if width is None else width
        w = 1.0 + self.normal(n, std=0.1)
        return self.nn.NormWeights(w, self.normal(n, std=0.1) if cfg.norm == "layernorm" else None)

    def attention(self, cfg, d_kv_in):
        d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return self.nn.AttentionWeights(self.linear(d, q), self.linear(d_kv_in, kv), self.linear(d_kv_in, kv),
                                        self.linear(q, d), self.b(q), self.b(kv), self.b(kv), self.b(d))

    def layer(self, cfg, d_source=None):
        d, F = cfg.d_model, cfg.ffn_dim
        attn, n1, n2 = self.attention(cfg, d), self.norm(cfg), self.norm(cfg)
        if cfg.ffn_gated:
            ffn = self.nn.FFNWeights(self.linear(d, F), self.linear(F, d), self.linear(d, F), None, self.b(d))
        else:
            ffn = self.nn.FFNWeights(self.linear(d, F), self.linear(F, d), None, self.b(F), self.b(d))
        extra = {}
        if cfg.qk_norm:
            extra.update(q_norm=self.norm(cfg, cfg.head_dim), k_norm=self.norm(cfg, cfg.head_dim))
        if cfg.post_norms:
            extra.update(post_norm1=self.norm(cfg), post_norm2=self.norm(cfg))
        if d_source is None:
            return self.nn.LayerWeights(attn, ffn, n1, n2, **extra)
        return self.nn.LayerWeights(attn, ffn, n1, n2, self.attention(cfg, d_source), self.norm(cfg), **extra)

    def pos_table(self, cfg):
        """A learned table of position_offset + max_positions rows; None otherwise (the model fills
        in its sinusoidal table)."""
        if cfg.position != "learned":
            return None
        return self.normal(cfg.position_offset + cfg.max_positions, cfg.d_model)

    def stack(self, cfg, d_source=None):
        """The keyword arguments of a decoder stack (embeddings, layers, norms, LM head)."""
        d, V = cfg.d_model, cfg.vocab_size
        return dict(embed=self.normal(V, d), layers=[self.layer(cfg, d_source) for _ in range(cfg.n_layers)],
                    final_norm=self.norm(cfg) if cfg.final_norm else None, lm_head=self.linear(d, V),
                    lm_bias=self.b(V), pos_embed=self.pos_table(cfg),
                    embed_norm=self.norm(cfg) if cfg.embed_norm else None)


def _dims(*values):
    return dict(zip(("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"), values))


def _random_setup(what, dims, seed, scale, bias, options, defaults):
    """Checked (nn, ModelConfig, _Weights) of a random model: KVSimdError naming a bad argument."""
    nn = _nn()
    seed = _kvsimd._need_int(seed, "seed")
    if seed < 0:
        raise KVSimdValueError("%s: seed must be an integer >= 0, got %d" % (what, seed))
    scale = _kvsimd._need_real(scale, "scale")
    if not (math.isfinite(scale) and scale > 0):
        raise KVSimdValueError("%s: scale must be finite and > 0, got %r" % (what, scale))
    if not isinstance(bias, (bool, np.bool_)):
        raise KVSimdTypeError("%s: bias must be True or False, got %r" % (what, bias))
    try:
        params = inspect.signature(nn.ModelConfig).parameters
    except (TypeError, ValueError):      # a class without a signature: its constructor will say
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise KVSimdTypeError("%s: unknown option %s (options are ModelConfig fields other than the "
                                  "dimensions: %s)" % (what, ", ".join(map(repr, unknown)),
                                                       ", ".join(p for p in params if p not in dims)))
    kw = dict(defaults)
    if options.get("position", "rope") in ("learned", "sinusoidal"):
        kw["max_positions"] = 256
    kw.update(options)
    try:
        cfg = nn.ModelConfig(**dims, **kw)
    except KVSimdError:
        raise
    except TypeError as e:
        raise KVSimdTypeError("%s: %s" % (what, e)) from None
    return nn, cfg, _Weights(nn, seed, scale, bias)


def _weights_bytes(cfg, cross=False, embeddings=True):
    """Bytes of the float32 weights :class:`_Weights` draws for ``cfg``'s stack, about (norms and
    biases left out), in Python integers: no overflow whatever the dimensions.  ``embeddings``:
    the token embeddings and LM head (an encoder has neither: it shares the decoder's)."""
    d, q, kv, F = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    attn = 2 * d * q + 2 * d * kv
    layer = attn * (2 if cross else 1) + (3 if cfg.ffn_gated else 2) * d * F
    pos = (cfg.position_offset + cfg.max_positions) * d if cfg.position == "learned" else 0
    return 4 * (2 * cfg.vocab_size * d * embeddings + pos + cfg.n_layers * layer)


def _check_memory(what, nbytes, dims):
    """KVSimdValueError when a random model's weights would not fit in this machine's memory: numpy
    would raise MemoryError, or the kernel's OOM killer end the process while the weights are drawn."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if nbytes > phys:
        raise KVSimdValueError("%s: these dimensions (%s) make %.3g GiB of float32 weights, more than this "
                               "machine's %.3g GiB of memory" % (what, ", ".join("%s=%d" % kv for kv in dims.items()),
                                                                 nbytes / 2**30, phys / 2**30))


def random_decoder(vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, *, seed=0, scale=1.0,
                   bias=False, **options):
    """A tiny :class:`kvsimd.Decoder` with random weights, built without torch (tests, benchmarks,
    experiments).  ``options`` are :class:`kvsimd.ModelConfig` fields (``norm``, ``activation``,
    ``ffn_gated``, ``position``, ``rope_style``, ``rotary_dim``, ``rope_scaling``, ``pre_norm``,
    ``parallel_residual``, ``embed_norm``, ``final_norm``, ``embed_scale``, ...);
    ``bias=True`` gives every linear layer (and the LM head) a bias; layernorms always have one.
    Weights are drawn by ``numpy.random.default_rng(seed)`` (same seed, same model) with
    standard deviation ``scale / sqrt(fan_in)``, so the logits are O(1).  Learned or sinusoidal
    positions get ``max_positions=256`` unless given.  A bad dimension, option or value raises a
    :class:`kvsimd.KVSimdError` naming it.

    >>> from kvsimd.testing import random_decoder
    >>> d = random_decoder(64, 32, 2, 4, 2, 8, 48, seed=1, norm="layernorm", activation="gelu")
    >>> d.forward([1, 2, 3]).shape
    (3, 64)
    >>> len(list(d.generate([1, 2, 3], max_new_tokens=5)))
    5
    """
    dims = _dims(vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim)
    nn, cfg, w = _random_setup("random_decoder", dims, seed, scale, bias, options, {})
    if cfg.cross_attention:
        raise KVSimdValueError("random_decoder: cross_attention=True needs an encoder: use random_encoder_decoder")
    _check_memory("random_decoder", _weights_bytes(cfg), dims)
    return nn.Decoder(cfg, **w.stack(cfg))


def random_encoder_decoder(vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, *, enc_layers=None,
                           seed=0, scale=1.0, bias=False, **options):
    """A tiny :class:`kvsimd.EncoderDecoder` with random weights, as :func:`random_decoder`: the
    encoder has ``enc_layers`` layers (default ``n_layers``) and the same options; positions are
    ``learned`` (default) or ``sinusoidal`` (the encoder takes no others), with no parallel
    residual (not defined with cross-attention); the decoder starts
    from ``decoder_start_token_id`` (default ``vocab_size - 1``).

    >>> from kvsimd.testing import random_encoder_decoder
    >>> m = random_encoder_decoder(64, 32, 2, 4, 4, 8, 48, pre_norm=False)
    >>> len(list(m.generate([5, 6, 7], max_new_tokens=4)))
    4
    """
    dims = _dims(vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim)
    what = "random_encoder_decoder"
    if "cross_attention" in options:
        raise KVSimdTypeError("%s: cross_attention is not an option (the decoder has it, the encoder not)" % what)
    if options.get("parallel_residual"):
        raise KVSimdValueError("%s: parallel_residual=True is not defined with cross-attention (kvsimd's prefill "
                               "skips the cross-attention, its decode step adds it)" % what)
    defaults = dict(decoder_start_token_id=_kvsimd._need_int(vocab_size, "vocab_size") - 1)
    position = options.setdefault("position", "learned")
    if position not in ("learned", "sinusoidal"):
        raise KVSimdValueError("%s: position must be learned or sinusoidal (the encoder's), got %r" % (what, position))
    nn, cfg, w = _random_setup(what, dims, seed, scale, bias, dict(options, cross_attention=True), defaults)
    n_enc = n_layers if enc_layers is None else _kvsimd._need_int(enc_layers, "enc_layers")
    if n_enc < 1:
        raise KVSimdValueError("%s: enc_layers must be >= 1, got %d" % (what, n_enc))
    _, enc_cfg, _ = _random_setup(what, dict(dims, n_layers=n_enc), seed, scale, bias, options, defaults)
    _check_memory(what, _weights_bytes(cfg, cross=True) + _weights_bytes(enc_cfg, embeddings=False),
                  dict(dims, enc_layers=n_enc))
    dec = w.stack(cfg, d_source=enc_cfg.d_model)
    enc = [w.layer(enc_cfg) for _ in range(n_enc)]
    return nn.EncoderDecoder(cfg, enc_cfg, w.pos_table(enc_cfg), enc, w.norm(enc_cfg) if enc_cfg.final_norm else None,
                             w.norm(enc_cfg) if enc_cfg.embed_norm else None, **dec)
