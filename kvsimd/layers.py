"""Transformer building blocks over NumPy float32 arrays.

Linear layers are BLAS matrix products through NumPy (weights stored as ``[in, out]`` so a
row of activations multiplies directly); attention over cached K/V runs in kvsimd's kernels.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvsimd import ops
from kvsimd import _kvsimd
from kvsimd.errors import KVSimdError, KVSimdTypeError, KVSimdValueError

F32 = np.float32

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "alibi", "learned", "sinusoidal")

# Every assignment to a weights object or a ModelConfig bumps this counter, so a model can tell
# cheaply (one integer compare per call) whether it must validate its weights again.
_generation = [0]


def weights_generation():
    """A counter that changes whenever any ModelConfig or weights object is assigned to."""
    return _generation[0]


class _Tracked:
    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        _generation[0] += 1


# ------------------------------------------------------------------------------ config
@dataclass
class ModelConfig(_Tracked):
    """Everything the forward pass needs to know about an architecture."""
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    activation: str = "silu"          # silu | gelu | gelu_tanh | relu  (gated: see ffn_gated)
    ffn_gated: bool = False           # SwiGLU-style: act(x W1) * (x W3)
    norm: str = "rmsnorm"             # rmsnorm | layernorm
    norm_eps: float = 1e-6
    pre_norm: bool = True             # False: post-norm (BART/Marian)
    parallel_residual: bool = False   # GPT-NeoX: x + attn(ln1 x) + ffn(ln2 x)
    position: str = "rope"            # rope | alibi | learned | sinusoidal
    rope_theta: float = 10000.0
    rope_style: str = "neox"          # pairing of the stored q/k layout
    rotary_dim: Optional[int] = None
    max_positions: int = 1 << 20
    position_offset: int = 0          # BART's learned positions start at row 2
    embed_scale: float = 1.0
    embed_norm: bool = False          # a norm right after the embeddings (BLOOM, BART)
    final_norm: bool = True
    cross_attention: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    decoder_start_token_id: Optional[int] = None
    family: str = ""

    def __post_init__(self):
        if self.rotary_dim is None and isinstance(self.head_dim, (int, np.integer)):
            self.rotary_dim = self.head_dim
        check_config(self)


def _real(x, name):
    """``x`` as a float: a real number (bools are not) that fits a double, else a KVSimdError naming
    ``name`` (the boundary's one rule, kvsimd._kvsimd._need_real)."""
    return _kvsimd._need_real(x, name)


BOOL_FIELDS = ("ffn_gated", "pre_norm", "parallel_residual", "embed_norm", "final_norm", "cross_attention")


def check_config(cfg, what="config"):
    """Every field the forward pass reads, checked once (at construction and whenever a model
    re-validates after an assignment)."""
    need_int = _kvsimd._need_int
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                 "max_positions"):
        v = need_int(getattr(cfg, name), "%s.%s" % (what, name))
        if v < 1:
            raise KVSimdValueError("%s.%s must be >= 1, got %d" % (what, name, v))
    if need_int(cfg.position_offset, what + ".position_offset") < 0:
        raise KVSimdValueError("%s.position_offset must be >= 0, got %d" % (what, cfg.position_offset))
    for name in BOOL_FIELDS:
        v = getattr(cfg, name)
        if not isinstance(v, (bool, np.bool_)):
            raise KVSimdTypeError("%s.%s must be a bool, got %r" % (what, name, v))
    if cfg.n_heads % cfg.n_kv_heads:
        raise KVSimdValueError("n_heads=%d must be a multiple of n_kv_heads=%d" % (cfg.n_heads, cfg.n_kv_heads))
    for name, allowed in (("activation", ACTIVATIONS), ("norm", NORMS), ("position", POSITIONS)):
        if getattr(cfg, name) not in allowed:
            raise KVSimdValueError("%s.%s must be one of %s, got %r"
                                   % (what, name, ", ".join(allowed), getattr(cfg, name)))
    reals = (("norm_eps", 0.0), ("embed_scale", None))
    if cfg.position != "rope":        # with RoPE, theta follows the kernels' rule below
        reals += (("rope_theta", None),)
    for name, lo in reals:
        v = _real(getattr(cfg, name), "%s.%s" % (what, name))
        if not math.isfinite(v) or (lo is not None and v < lo):
            raise KVSimdValueError("%s.%s must be finite%s, got %r"
                                   % (what, name, "" if lo is None else " and >= 0", v))
    if cfg.position == "rope":
        # the kernels' own rule for theta, style and rotary_dim (ops.apply_rope, KVCache.step_plan),
        # so a config accepted here is never refused by every prefill
        need_int(cfg.rotary_dim, what + ".rotary_dim")
        try:
            _kvsimd._rope_params(cfg.rope_theta, cfg.rope_style, cfg.rotary_dim, cfg.head_dim)
        except KVSimdError as e:
            # the boundary's message, which starts with the argument's name, naming the config field
            arg, rest = re.match(r"(\w*)(.*)", str(e), re.S).groups()
            field = {"theta": "rope_theta", "style": "rope_style"}.get(arg, arg)
            raise type(e)("%s.%s%s" % (what, field, rest)) from None


# ------------------------------------------------------------------------------ functions
try:  # SciPy's erf when it is installed (resolved once: a failed import per call is slow)
    from scipy.special import erf as _scipy_erf
except ImportError:
    _scipy_erf = None


def _erf(x):
    """erf to ~1e-7 absolute (Abramowitz & Stegun 7.1.26 is 1.5e-7); float32-adequate."""
    if _scipy_erf is not None:
        return _scipy_erf(x)
    s = np.sign(x)
    a = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-a * a)
    return (s * y).astype(x.dtype)


def activation(name, x):
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    if name == "relu":
        return np.maximum(x, 0)
    raise KVSimdValueError("unknown activation %r" % name)


def norm(cfg, x, w, b):
    # ufunc reductions directly (np.mean's Python layer costs more than the math at decode sizes)
    inv_n = x.dtype.type(1.0 / x.shape[-1])
    eps = x.dtype.type(cfg.norm_eps)
    if cfg.norm == "rmsnorm":
        r = np.sqrt(np.add.reduce(x * x, axis=-1, keepdims=True) * inv_n + eps)
        y = x / r
        y *= w
        return y
    xc = x - np.add.reduce(x, axis=-1, keepdims=True) * inv_n
    r = np.sqrt(np.add.reduce(xc * xc, axis=-1, keepdims=True) * inv_n + eps)
    xc /= r
    xc *= w
    if b is not None:
        xc += b
    return xc


def linear(x, w, b=None):
    y = x @ w
    return y + b if b is not None else y


def alibi_slopes(n_heads):
    """ALiBi head slopes (Press et al.), as BLOOM builds them for any head count."""
    p = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(p) - 3)))
    slopes = [base ** (i + 1) for i in range(p)]
    if p < n_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * p) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(n_heads - p)]
    return np.array(slopes, dtype=F32)


def sinusoidal_table(n_positions, dim):
    """Sinusoidal positions: sin in the first half of the dims, cos in the second (Marian)."""
    half = dim // 2
    inv = np.power(10000.0, -np.arange(half, dtype=np.float64) * 2.0 / dim)
    ang = np.arange(n_positions, dtype=np.float64)[:, None] * inv[None, :]
    table = np.zeros((n_positions, dim), dtype=np.float64)
    table[:, :half] = np.sin(ang)
    table[:, half:2 * half] = np.cos(ang)
    return table.astype(F32)


def causal_attention(q, k, v, q_start, slopes=None, causal=True):
    """Attention of queries ``q [H, T, D]`` at positions ``q_start..q_start+T-1`` over keys
    ``k, v [Hkv, S, D]`` at positions ``0..S-1`` (float32 math; GQA by head groups).
    Used for prefill and for encoders; decode steps use the cache kernel."""
    H, T, D = q.shape
    Hkv, S, _ = k.shape
    G = H // Hkv
    qg = q.reshape(Hkv, G * T, D)
    s = np.matmul(qg, np.swapaxes(k, 1, 2)).reshape(H, T, S) * (1.0 / math.sqrt(D))
    qpos = np.arange(q_start, q_start + T)[:, None]
    kpos = np.arange(S)[None, :]
    if slopes is not None:
        s = s - slopes[:, None, None] * (qpos - kpos)[None].astype(F32)
    if causal:
        s = np.where((kpos > qpos)[None], -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.matmul(p.reshape(Hkv, G * T, S), v).reshape(H, T, D).astype(F32)


# ------------------------------------------------------------------------------ weights
def _f32(a, name):
    """``a`` as a C-contiguous float32 array (weights are converted once, at construction)."""
    if a is None:
        raise KVSimdTypeError("%s must be an array of real numbers, got None" % name)
    try:
        return np.ascontiguousarray(a, dtype=F32)
    except (TypeError, ValueError) as e:
        raise KVSimdTypeError("%s must be an array of real numbers, got %s: %s"
                              % (name, type(a).__name__, e)) from None


def _fuse_columns(parts, what):
    """Concatenate 2-D ``[in, out_i]`` matrices (or 1-D biases) along their last axis."""
    shapes = [getattr(p, "shape", None) for p in parts]
    if any(sh is None or len(sh) != len(shapes[0]) or sh[:-1] != shapes[0][:-1] for sh in shapes):
        raise KVSimdValueError("%s: the parts must agree in all but their last dimension, got shapes %s"
                               % (what, ", ".join(str(sh) for sh in shapes)))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


@dataclass
class AttentionWeights(_Tracked):
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: Optional[np.ndarray] = None
    bk: Optional[np.ndarray] = None
    bv: Optional[np.ndarray] = None
    bo: Optional[np.ndarray] = None
    wqkv: np.ndarray = field(init=False, repr=False)
    bqkv: Optional[np.ndarray] = field(init=False, repr=False)

    _PARTS = ("wq", "wk", "wv", "bq", "bk", "bv")

    def __post_init__(self):
        for name in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"):
            a = getattr(self, name)
            if a is not None:
                object.__setattr__(self, name, _f32(a, name))
        self._fuse()
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name, value):
        # assigning wq/wk/wv (or their biases) after construction re-fuses wqkv/bqkv, so the
        # fused matrices the decoder multiplies never go stale
        super().__setattr__(name, value)
        if name in self._PARTS and self.__dict__.get("_ready"):
            self._fuse()

    def _fuse(self):
        # one matrix product for q, k and v
        self.wqkv = _fuse_columns([self.wq, self.wk, self.wv], "wq, wk, wv")
        if self.bq is None and self.bk is None and self.bv is None:
            self.bqkv = None
        else:
            z = lambda b, w: b if b is not None else np.zeros(w.shape[-1], F32)  # noqa: E731
            self.bqkv = _fuse_columns([z(self.bq, self.wq), z(self.bk, self.wk), z(self.bv, self.wv)],
                                      "bq, bk, bv")


@dataclass
class FFNWeights(_Tracked):
    w1: np.ndarray
    w2: np.ndarray
    w3: Optional[np.ndarray] = None   # gate partner (gated FFN)
    b1: Optional[np.ndarray] = None
    b2: Optional[np.ndarray] = None
    w13: Optional[np.ndarray] = field(init=False, repr=False, default=None)

    def __post_init__(self):
        for name in ("w1", "w2", "w3", "b1", "b2"):
            a = getattr(self, name)
            if a is not None:
                object.__setattr__(self, name, _f32(a, name))
        self._fuse()
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in ("w1", "w3") and self.__dict__.get("_ready"):
            self._fuse()

    def _fuse(self):
        self.w13 = None if self.w3 is None else _fuse_columns([self.w1, self.w3], "w1, w3")


@dataclass
class NormWeights(_Tracked):
    w: np.ndarray
    b: Optional[np.ndarray] = None

    def __post_init__(self):
        self.w = _f32(self.w, "w")
        if self.b is not None:
            self.b = _f32(self.b, "b")


@dataclass
class LayerWeights(_Tracked):
    attn: AttentionWeights
    ffn: FFNWeights
    norm1: NormWeights                  # before (pre-norm) / after (post-norm) self-attention
    norm2: NormWeights                  # FFN
    cross: Optional[AttentionWeights] = None
    norm_cross: Optional[NormWeights] = None


def ffn(cfg, f: FFNWeights, x):
    if f.w13 is not None:
        h = x @ f.w13
        n = f.w1.shape[1]
        h = activation(cfg.activation, h[..., :n]) * h[..., n:]
    else:
        h = activation(cfg.activation, linear(x, f.w1, f.b1))
    return linear(h, f.w2, f.b2)


def split_heads(x, n_heads, head_dim):
    """[T, n_heads * head_dim] -> C-contiguous [n_heads, T, head_dim]"""
    T = x.shape[0]
    return np.ascontiguousarray(x.reshape(T, n_heads, head_dim).transpose(1, 0, 2))


def merge_heads(x):
    """[n_heads, T, head_dim] -> [T, n_heads * head_dim]"""
    H, T, D = x.shape
    return x.transpose(1, 0, 2).reshape(T, H * D)


def rope(cfg, x, positions):
    if cfg.position == "rope":
        ops.apply_rope(x, positions, theta=cfg.rope_theta, style=cfg.rope_style, rotary_dim=cfg.rotary_dim)
    return x


# ------------------------------------------------------------------------------ validation
def need_weight(a, name, shape, optional=False):
    """``a`` must be a float32, C-contiguous, aligned array of exactly ``shape`` (the compiled
    decode step reads weights by pointer with lengths taken from the ModelConfig)."""
    if a is None:
        if optional:
            return None
        raise KVSimdTypeError("%s must be a float32 array of shape %s, got None" % (name, shape))
    _kvsimd._need_array(a, name, (np.dtype(F32),), len(shape), str(shape))
    if any(want is not None and got != want for got, want in zip(a.shape, shape)) or 0 in a.shape:
        raise KVSimdValueError("%s must have shape %s, got %s"
                               % (name, str(shape).replace("None", "n >= 1"), a.shape))
    return a


def need_norm(nw, name, d, optional=False):
    if nw is None and optional:
        return
    if not isinstance(nw, NormWeights):
        raise KVSimdTypeError("%s must be a NormWeights, got %r" % (name, type(nw).__name__))
    need_weight(nw.w, name + ".w", (d,))
    need_weight(nw.b, name + ".b", (d,), optional=True)


def _need_attention(a, name, d, d_kv_in, H, Hkv, Dh, fused):
    if not isinstance(a, AttentionWeights):
        raise KVSimdTypeError("%s must be an AttentionWeights, got %r" % (name, type(a).__name__))
    for part, shape in (("wq", (d, H * Dh)), ("wk", (d_kv_in, Hkv * Dh)), ("wv", (d_kv_in, Hkv * Dh)),
                        ("wo", (H * Dh, d))):
        need_weight(getattr(a, part), "%s.%s" % (name, part), shape)
    for part, n in (("bq", H * Dh), ("bk", Hkv * Dh), ("bv", Hkv * Dh), ("bo", d)):
        need_weight(getattr(a, part), "%s.%s" % (name, part), (n,), optional=True)
    if fused:
        n = (H + 2 * Hkv) * Dh
        need_weight(a.wqkv, name + ".wqkv", (d, n))
        need_weight(a.bqkv, name + ".bqkv", (n,), optional=True)


def check_layer(cfg, lw, name, d_source=None):
    """Every array of one layer against the ModelConfig: shapes, float32, C-contiguity.
    ``d_source``: width of the encoder output when the layer has cross-attention."""
    if not isinstance(lw, LayerWeights):
        raise KVSimdTypeError("%s must be a LayerWeights, got %r" % (name, type(lw).__name__))
    d, H, Hkv, Dh, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    need_norm(lw.norm1, name + ".norm1", d)
    need_norm(lw.norm2, name + ".norm2", d)
    _need_attention(lw.attn, name + ".attn", d, d, H, Hkv, Dh, True)
    if d_source is not None:
        need_norm(lw.norm_cross, name + ".norm_cross", d)
        _need_attention(lw.cross, name + ".cross", d, d_source, H, Hkv, Dh, False)
    f = lw.ffn
    if not isinstance(f, FFNWeights):
        raise KVSimdTypeError("%s.ffn must be an FFNWeights, got %r" % (name, type(f).__name__))
    need_weight(f.w1, name + ".ffn.w1", (d, F))
    need_weight(f.w2, name + ".ffn.w2", (F, d))
    need_weight(f.b2, name + ".ffn.b2", (d,), optional=True)
    if cfg.ffn_gated:
        need_weight(f.w3, name + ".ffn.w3", (d, F))
        need_weight(f.w13, name + ".ffn.w13", (d, 2 * F))
        if f.b1 is not None:
            raise KVSimdValueError("%s.ffn.b1: a gated FFN (ffn_gated=True) takes no b1" % name)
    else:
        if f.w3 is not None or f.w13 is not None:
            raise KVSimdValueError("%s.ffn.w3 is set but the config has ffn_gated=False" % name)
        need_weight(f.b1, name + ".ffn.b1", (F,), optional=True)
